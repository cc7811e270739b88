"""Tests that launch no process: the library in this process (torch only where the code under test uses it)."""
