"""The trainer loop's stages (reading, stepping, settling, publishing), each owning its task in flight and its
timestamps; what runs beside what is stated once, in services/trainer/loop.py."""
