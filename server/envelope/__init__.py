"""The request's envelope: every API request authenticated once (``server.identity``),
admitted (``server.limits``), traced and accounted for (status, time to first byte, the
request log, the usage ledger), byte-identical repeats of cached answers included."""
