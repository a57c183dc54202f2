"""The decode node: slots, control port, decode loop and its HTTP API."""
