"""What the claim scripts of ``bench/`` share; no claim of its own.

``support.py`` (statistics, progress lines, exit statuses, cores, the gateway's start and
stop around ``harness.gateway.GatewayProcess``, other child servers, gateway configs),
``wrk.py`` (wrk's report), ``chat_hit.py`` (one chat request an exact hit answers, the fake
vLLM behind it), ``cpu_probe.py`` (the CPU probes' fake vLLM process and gateway),
``minimal_proxy.py`` and ``cpu_burn.py`` (run by ``overhead.py`` as processes of their own),
and the pieces of the two largest scripts, ``exact_hit/`` and ``overhead/``.
"""
