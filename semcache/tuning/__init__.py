"""Offline tuning of the semantic matcher: labelled pairs, calibration, the stream
evaluation and the pair verifier's training (``semcache calibrate``, ``train-verifier``).

Nothing at run time imports this package."""
