"""Examples of conch in services; each is run by a test (tests/test_recipes.py and others)."""
