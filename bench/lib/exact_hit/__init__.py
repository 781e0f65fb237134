"""The pieces of ``bench/exact_hit.py``: the requests, the servers compared, wrk's load and
the report."""
