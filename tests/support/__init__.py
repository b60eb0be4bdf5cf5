"""Helpers the tests, benchmarks and screenshot script share; not part of the shipped package."""
