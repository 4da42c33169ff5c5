"""keel's user-facing Python entry points beside the compiler (`compiler.pipeline.compile_model`)
and the runner (`runner.Model`): `keel.backend`, the standard onnx.backend interface, as
onnxruntime.backend is for onnxruntime. The command-line tools install as console commands
(keel-compile, keel-run, ...: setup.cfg, README "Installing")."""
