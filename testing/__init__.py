"""Test support that is not trainer code: tiny random models for the tests, the CPU demo and the benches.

Not part of the installed distribution (like tests/); import it from the repository root, as pytest
(pythonpath ".") and the bench scripts do.
"""
