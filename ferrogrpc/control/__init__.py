"""Control: how ranks find each other (rendezvous, the coordinator and its
client) and how local ranks are launched."""
