"""Artifacts: the manifest, export, verified load, the runtime around a loaded model, the fbgemm
libraries a host needs, and the request/response files shared with the C++ loader."""
