"""The artifact's format back-ends, one module per format and direction: TorchScript (``model.pt``, the
default and the C++ loader's), pt2 (``model.pt2``, torch.export + AOTInductor) and ONNX (``model.onnx``).
``infer.artifact.export`` and ``infer.artifact.load`` choose among them; the manifest describes them all."""
