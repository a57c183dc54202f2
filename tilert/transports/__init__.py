"""Byte movers between the prefill node's staging buffers and the decode node's registered buffers."""

from tilert.transports.base import Receiver, Sender, TransferError, Transport

__all__ = ["Receiver", "Sender", "TransferError", "Transport"]
