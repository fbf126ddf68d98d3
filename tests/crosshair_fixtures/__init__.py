"""Deliberately wrong code the CrossHair gate must catch."""
