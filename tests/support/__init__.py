"""Shared test corpora, used by the tests of every entry point."""
