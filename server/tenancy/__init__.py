"""Tenancy: who calls (authentication), how much they may (limits), what they used (ledger)."""
