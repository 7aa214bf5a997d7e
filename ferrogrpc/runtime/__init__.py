"""The runtime of a rank: joining the group, the engine every collective goes
through, the asyncio Peer and the blocking Backend."""
