"""Small stand-ins for optional libraries, injected into ``sys.modules`` by test fixtures."""
