"""Stand-ins for the servers around the router, shared by the tests and the benchmarks (never by the product)."""
