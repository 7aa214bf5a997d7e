"""Elastic training: a group whose membership changes while it trains (a
lost rank, a joiner), epoch by epoch through the coordinator, and the live
state a joiner receives from every member."""
