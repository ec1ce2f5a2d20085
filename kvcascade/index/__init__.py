"""Bookkeeping: synchronous, no I/O, no asyncio."""

from .cpu import CPUOffloadingManager, CPUTierStats

__all__ = ["CPUOffloadingManager", "CPUTierStats"]
