"""Verified mode (chat): per-entry curves of when an entry's answer is right, the lookup that
serves or explores, and the judges of an explored answer."""
