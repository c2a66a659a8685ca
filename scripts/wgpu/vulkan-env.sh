# Sourced on the GPU host (no network) before anything runs on Vulkan: unpacks the Vulkan
# loader and its GL dependencies carried in .gl (download them here with
# scripts/wgpu/bundle.sh) and points the loader at NVIDIA's ICD.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
