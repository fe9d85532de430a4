"""Generated from proto/specd/v1 by clients/python/gen_protos.py (committed; checked in CI)."""
