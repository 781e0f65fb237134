"""The pieces of ``bench/overhead.py``: the cells, the timed chat requests, the batches and
windows of load, the runs of them, the report and the session that starts the servers."""
