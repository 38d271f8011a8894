"""Examples of conch in services; each is run by a test (tests/library/test_recipes.py, others)."""
