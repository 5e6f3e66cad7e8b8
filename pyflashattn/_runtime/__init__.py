"""The runtime: driver glue, cubin registry, DLPack reader, tensors/outputs/streams, dtypes and the
generated params mirror. It imports nothing from the engine or the API facades."""
