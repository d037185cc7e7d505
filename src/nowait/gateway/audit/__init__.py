"""The audit log: one hash-chained JSONL entry per request (chain.py: what is hashed; log.py: the
writer and readers), its verification (verify.py) and what each tenant spent (spend.py)."""

from nowait.gateway.audit.chain import GENESIS, LOCAL_REPLICA, canonical, entry_hash
from nowait.gateway.audit.log import AuditLog, read_audit_log
from nowait.gateway.audit.verify import Break, Verdict, verify_audit_log

__all__ = ["GENESIS", "LOCAL_REPLICA", "AuditLog", "Break", "Verdict", "canonical", "entry_hash", "read_audit_log",
           "verify_audit_log"]
