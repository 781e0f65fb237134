"""The probes a load balancer and a scraper use: ``/``, ``/health``, ``/ready`` (``probes``)
and ``/metrics`` (``scrape``); none needs a token."""
