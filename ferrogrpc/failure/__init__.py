"""Failure: whom to blame when a collective fails (the policy), and how long a
wait may last (the watchdog)."""
