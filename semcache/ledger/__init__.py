"""The usage and cost ledger: what each tenant used and saved, per model, route and UTC day.

The serving path adds one :class:`UsageRecord` per answered request, priced at the policy's
prices; the ledger sums records in memory and writes them in batches to SQLite under the
data directory or to Redis counters shared by several gateways. Never HTTP: the server's
``/v1/usage`` route and the budget checks read it through :class:`UsageLedger`.
"""

from semcache.ledger.base import (
    BufferedLedger,
    LedgerUnavailable,
    NullLedger,
    Period,
    Storage,
    UsageLedger,
)
from semcache.ledger.factory import open_ledger
from semcache.ledger.records import (
    KEY_FIELDS,
    SUM_FIELDS,
    Spend,
    UsageRecord,
    utc_day,
    utc_month,
)
from semcache.ledger.settings import LedgerSettings

__all__ = [
    "KEY_FIELDS",
    "SUM_FIELDS",
    "BufferedLedger",
    "LedgerSettings",
    "LedgerUnavailable",
    "NullLedger",
    "Period",
    "Spend",
    "Storage",
    "UsageLedger",
    "UsageRecord",
    "open_ledger",
    "utc_day",
    "utc_month",
]
