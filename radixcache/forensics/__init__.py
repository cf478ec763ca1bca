"""Slot-checksum forensics: the ledger (an event log), the recorder the manager calls (fingerprint
at donation, verify before restore) and the report that reads a ledger back."""

from .ledger import Ledger, read_ledger
from .recorder import HOLDERS_KEPT, SAMPLED, Forensics, SnapshotCorruption, key_digest
from .report import ForensicsReport, analyze, format_forensics

__all__ = [
    "HOLDERS_KEPT",
    "SAMPLED",
    "Forensics",
    "ForensicsReport",
    "Ledger",
    "SnapshotCorruption",
    "analyze",
    "format_forensics",
    "key_digest",
    "read_ledger",
]
