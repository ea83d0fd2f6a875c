"""The wire schema of the ``grpc://`` transport (``transport.proto``) and the modules
generated from it by ``scripts/gen-proto``.

The adapter does not import the generated modules (it hand-codes the frames); they are
here for tests, tooling and clients in other languages. Generated with grpcio-tools
1.85.1: importing them needs protobuf >= 7.35.1 and grpcio >= 1.85.1.
"""
