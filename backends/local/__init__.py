"""Models the gateway runs in process: sentence encoders (torch or a checked ONNX graph),
the local embedding backend, and the sentiment classifier with its shipped head
(``data/``)."""
