#!/usr/bin/env bash
# Make a Debian 12 machine without a GPU able to build and run the vulkan lane on a software device.
#
# usage: scripts/vulkan_sw_setup.sh [--sdk DIR]     (as root; DIR default .ci-sdk/vulkan)
#
# Installs Debian's glslc, SPIR-V headers, Vulkan loader and vulkaninfo, and Mesa's Vulkan drivers, whose
# llvmpipe ("lavapipe") is a Vulkan device that runs on the CPU. Mesa comes from bookworm-backports
# (25.0): Debian 12's own Mesa 22.3 corrupts its heap once ggml frees a device buffer that an earlier
# graph used (seen here as "double free or corruption" inside libvulkan_lvp.so mid-compute).
# Debian 12's Vulkan headers (1.3.239) are older than ggml-vulkan needs (VK_EXT_layer_settings,
# 1.3.272), so the headers of Debian 13's libvulkan-dev are unpacked into DIR/include; nothing else
# comes from Debian 13 and nothing of it is installed system-wide.
# Prints the two variables to export before scripts/build_ggml_lane.sh vulkan:
#   VULKAN_SDK=DIR              CMake's FindVulkan takes the headers from DIR/include
#   GGML_VK_VISIBLE_DEVICES=0   ggml-vulkan uses a CPU-type device only when told to
# llvmpipe proves that the lane's build, placement and certification paths work and that ggml's Vulkan
# kernels agree with the CPU on the golden models; its speed says nothing about a GPU's.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SDK="$ROOT/.ci-sdk/vulkan"
while [ $# -gt 0 ]; do
  case "$1" in
    --sdk) [ $# -ge 2 ] || { echo "error: --sdk needs a directory" >&2; exit 2; }; SDK="$2"; shift 2 ;;
    -h|--help) sed -n '4,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$(id -u)" != 0 ]; then
  echo "error: run as root (it installs Debian packages with apt-get)" >&2
  exit 2
fi

export DEBIAN_FRONTEND=noninteractive
BPO=/etc/apt/sources.list.d/bookworm-backports.list
if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
  echo "deb http://deb.debian.org/debian bookworm-backports main" > "$BPO"
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends glslc spirv-headers libvulkan-dev libvulkan1 vulkan-tools >/dev/null
apt-get install -y -qq --no-install-recommends -t bookworm-backports mesa-vulkan-drivers >/dev/null

if ! grep -q "#define VK_EXT_layer_settings 1" /usr/include/vulkan/vulkan_core.h; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/lists"
  echo "deb http://deb.debian.org/debian trixie main" > "$work/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq
  (cd "$work" && apt-get "${apt_opts[@]}" download libvulkan-dev >/dev/null 2>&1)
  dpkg-deb -x "$work"/libvulkan-dev_*.deb "$work/x"
  rm -rf "$SDK/include"
  mkdir -p "$SDK"
  cp -r "$work/x/usr/include" "$SDK/include"
  echo "Debian 13's Vulkan headers ($(basename "$work"/libvulkan-dev_*.deb)) unpacked into $SDK/include" >&2
  echo "export VULKAN_SDK=$SDK"
fi
GGML_VK_VISIBLE_DEVICES=0 vulkaninfo --summary 2>/dev/null | grep -E "deviceName|deviceType" >&2 || true
echo "export GGML_VK_VISIBLE_DEVICES=0"
