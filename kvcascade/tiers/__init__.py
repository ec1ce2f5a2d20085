"""Data movement: one actor per medium (device, fs, memory) and the primary tier's buffer."""
