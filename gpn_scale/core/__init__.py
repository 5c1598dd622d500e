"""Leaf package: errors and config resolution shared by every other package."""
