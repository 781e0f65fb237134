"""A small surface in one package, registered by a test (``test_surface_registration.py``):
the proof that a surface gets the shared layers without a change to them."""
