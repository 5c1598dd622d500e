"""Test helpers that are also useful by hand (e.g. a local S3 endpoint)."""
