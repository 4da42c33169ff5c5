"""KEEL_USB=mock's GPU: a mock RX 7900 behind sim/usb's bridge (mock_device.py; its command
processor and memory mock_gpu.py, its compute queue mock_gc.py) and the stand-in firmware it
accepts (standin.py)."""
