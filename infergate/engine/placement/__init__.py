"""Where workers run: devices, memory reservations, and the monitors that enforce them."""
