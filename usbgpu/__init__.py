"""usbgpu: a PCIe device behind an ASM24xx USB-to-PCIe bridge, driven from user space over libusb
(libusb.py: cffi binding and batched transfers; asm24.py: the bridge protocol; pci.py: the
PCI-device interface am/ uses). sim/usb/mock.py answers the same libusb calls with a mock bridge."""
