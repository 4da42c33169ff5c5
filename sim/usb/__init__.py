"""KEEL_USB=mock: libusb's calls answered by a mock ASM24xx bridge with a PCIe hierarchy behind it
(mock.py)."""
