"""Test support: fakes and servers that honour the real wire contracts (no mocks of our own modules)."""
