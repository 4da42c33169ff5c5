"""usbgpu: a PCIe device behind an ASM24xx USB-to-PCIe bridge, driven from user space over libusb
(libusb.py: cffi binding and batched transfers; asm24.py: the bridge protocol; pci.py: the
PCI-device interface am/ uses; mock.py: the same libusb calls answered by a mock bridge)."""
