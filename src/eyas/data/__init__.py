"""Chats -> token ids + assistant-only loss masks (see prepare.py)."""
