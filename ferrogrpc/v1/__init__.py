"""Generated protobuf code for the ferrogrpc v1 wire contract (see proto/)."""
