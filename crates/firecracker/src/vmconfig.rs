//! What one VM is configured with: machine size (from effective limits →
//! label set → scaler default), kernel command line, drives, interface.

use crate::api::{BootSource, Drive, MachineConfiguration, NetworkInterface};
use crate::names::{KERNEL_FILE, OVERLAY_FILE, ROOTFS_FILE};
use kici_model::{EffectiveResources, FirecrackerLabelSet, ScalerEntry};
use std::net::Ipv4Addr;

/// Firecracker's limit on vCPUs (`MachineConfiguration.vcpu_count`).
pub const MAX_VCPUS: u32 = 32;
/// Overlay size when the label set names none.
pub const DEFAULT_OVERLAY_MIB: u32 = 2048;
/// The guest interface, as named in the boot args and the API.
pub const GUEST_IFACE: &str = "eth0";
/// Where MMDS answers inside the guest.
pub const MMDS_ADDRESS: &str = "169.254.169.254";

/// Boot arguments before `ip=`: serial console, reboot on triple fault
/// (so `reboot` ends Firecracker), panic → reboot after 1 s, and the i8042
/// flags Firecracker documents to skip probing its absent keyboard controller.
const BASE_BOOT_ARGS: &str = "console=ttyS0 reboot=k panic=1 random.trust_cpu=on \
i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd init=/init";

/// A machine size and how it was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineSize {
    pub vcpus: u32,
    pub mem_mib: u32,
}

/// How the effective limits were rounded to what Firecracker accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rounding {
    pub requested_millicpu: u64,
    pub requested_bytes: u64,
    pub size: MachineSize,
}

impl MachineSize {
    /// vCPUs: the limit rounded up to a whole vCPU, then to 1 or an even
    /// count (the spec: "either 1 or an even number"), at most 32. Memory:
    /// the limit floored to whole MiB. A zero limit (or one below 1 MiB)
    /// falls back to the label set's value, then the scaler's.
    pub fn resolve(
        scaler: &ScalerEntry,
        label_set: &FirecrackerLabelSet,
        resources: &EffectiveResources,
    ) -> (Self, Option<Rounding>) {
        let base_vcpus = label_set.vcpu_count.unwrap_or(scaler.vcpu_count);
        let base_mem = label_set.mem_size_mib.unwrap_or(scaler.mem_size_mib);
        let millicpu = resources.limits.cpu.millis();
        let bytes = resources.limits.memory.bytes();
        let vcpus = if millicpu > 0 {
            u32::try_from(millicpu.div_ceil(1000)).unwrap_or(u32::MAX)
        } else {
            base_vcpus
        };
        let vcpus = even_or_one(vcpus).clamp(1, MAX_VCPUS);
        let mib = resources.limits.memory.mib_floor();
        let mem_mib = if mib > 0 {
            u32::try_from(mib).unwrap_or(u32::MAX)
        } else {
            base_mem
        };
        let size = Self { vcpus, mem_mib };
        let rounded = (millicpu > 0 && u64::from(vcpus) * 1000 != millicpu)
            || (bytes > 0 && u64::from(mem_mib) * 1024 * 1024 != bytes);
        let rounding = rounded.then_some(Rounding {
            requested_millicpu: millicpu,
            requested_bytes: bytes,
            size,
        });
        (size, rounding)
    }

    pub fn api_body(self) -> MachineConfiguration {
        MachineConfiguration {
            vcpu_count: self.vcpus,
            mem_size_mib: self.mem_mib,
            smt: false,
        }
    }
}

fn even_or_one(n: u32) -> u32 {
    if n <= 1 {
        1
    } else {
        n + (n % 2)
    }
}

/// The guest's address on the bridge network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestNet {
    pub ip: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub netmask: Ipv4Addr,
}

impl GuestNet {
    /// `ip=<client>::<gateway>:<netmask>::<device>:off` (kernel IP autoconfig;
    /// no hostname, no DHCP).
    pub fn boot_arg(&self) -> String {
        format!(
            "ip={}::{}:{}::{GUEST_IFACE}:off",
            self.ip, self.gateway, self.netmask
        )
    }
}

pub fn boot_source(net: &GuestNet) -> BootSource {
    BootSource {
        kernel_image_path: format!("/{KERNEL_FILE}"),
        boot_args: Some(format!("{BASE_BOOT_ARGS} {}", net.boot_arg())),
    }
}

/// Read-only root (Firecracker adds `root=/dev/vda ro`), then the writable
/// overlay as `/dev/vdb`.
pub fn drives() -> [Drive; 2] {
    [
        Drive {
            drive_id: "rootfs".into(),
            path_on_host: format!("/{ROOTFS_FILE}"),
            is_root_device: true,
            is_read_only: true,
        },
        Drive {
            drive_id: "overlay".into(),
            path_on_host: format!("/{OVERLAY_FILE}"),
            is_root_device: false,
            is_read_only: false,
        },
    ]
}

pub fn network_interface(tap: &str, mac: &str) -> NetworkInterface {
    NetworkInterface {
        iface_id: GUEST_IFACE.into(),
        host_dev_name: tap.into(),
        guest_mac: Some(mac.into()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_model::{MemoryBytes, MilliCpu, Resources};

    fn scaler() -> ScalerEntry {
        let yaml = r#"
version: 1
scalers:
  - name: test-fc
    type: firecracker
    maxAgents: 1
    firecrackerPath: /usr/bin/firecracker
    jailerPath: /usr/bin/jailer
    kernelPath: /k
    uid: 10000
    gid: 10000
    labelSets:
      - labels: [linux]
        rootfsPath: /r
"#;
        let loaded = kici_config::load_documents(&[("s.yaml", yaml)]).unwrap();
        loaded.config.scaler("test-fc").unwrap().clone()
    }

    fn limits(millicpu: u64, bytes: u64) -> EffectiveResources {
        EffectiveResources {
            requests: Resources::default(),
            limits: Resources::new(
                MilliCpu::from_millis(millicpu),
                MemoryBytes::from_bytes(bytes),
            ),
        }
    }

    fn ls(vcpu: Option<u32>, mem: Option<u32>) -> FirecrackerLabelSet {
        FirecrackerLabelSet {
            rootfs_path: "/r".into(),
            kernel_path: None,
            vcpu_count: vcpu,
            mem_size_mib: mem,
            overlay_drive_size_mib: None,
        }
    }

    #[test]
    fn firecracker_machine_size_from_limits_label_set_and_defaults() {
        let s = scaler();
        let mib = 1024 * 1024;
        let (size, r) =
            MachineSize::resolve(&s, &ls(Some(4), Some(2048)), &limits(1000, 1024 * mib));
        assert_eq!(
            size,
            MachineSize {
                vcpus: 1,
                mem_mib: 1024
            }
        );
        assert!(r.is_none());
        let (size, r) = MachineSize::resolve(&s, &ls(Some(4), Some(2048)), &limits(500, 512 * mib));
        assert_eq!(
            size,
            MachineSize {
                vcpus: 1,
                mem_mib: 512
            }
        );
        assert!(r.is_some(), "0.5 cpu rounded up is logged");
        let (size, _) = MachineSize::resolve(&s, &ls(Some(4), Some(2048)), &limits(0, 0));
        assert_eq!(
            size,
            MachineSize {
                vcpus: 4,
                mem_mib: 2048
            }
        );
        let (size, _) = MachineSize::resolve(&s, &ls(None, None), &limits(0, 0));
        assert_eq!(
            size,
            MachineSize {
                vcpus: 2,
                mem_mib: 512
            }
        );
        // 2.5 cpus → 3 → 4 (1 or even); 1.5 GiB + 1 byte floors to 1536 MiB.
        let (size, r) = MachineSize::resolve(&s, &ls(None, None), &limits(2500, 1536 * mib + 1));
        assert_eq!(
            size,
            MachineSize {
                vcpus: 4,
                mem_mib: 1536
            }
        );
        assert_eq!(r.unwrap().requested_millicpu, 2500);
        // Below 1 MiB keeps the base; above 32 vCPUs is clamped.
        let (size, _) = MachineSize::resolve(&s, &ls(None, None), &limits(64_000, 1000));
        assert_eq!(
            size,
            MachineSize {
                vcpus: 32,
                mem_mib: 512
            }
        );
    }

    #[test]
    fn firecracker_boot_args_carry_ip_and_i8042_flags() {
        let net = GuestNet {
            ip: Ipv4Addr::new(10, 0, 0, 2),
            gateway: Ipv4Addr::new(10, 0, 0, 1),
            netmask: Ipv4Addr::new(255, 255, 255, 0),
        };
        let boot = boot_source(&net);
        assert_eq!(boot.kernel_image_path, "/kernel");
        let args = boot.boot_args.unwrap();
        assert!(
            args.ends_with(" ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off"),
            "{args}"
        );
        for flag in [
            "i8042.noaux",
            "i8042.nomux",
            "i8042.nopnp",
            "i8042.dumbkbd",
            "console=ttyS0",
        ] {
            assert!(args.split(' ').any(|a| a == flag), "{flag}");
        }
        let [root, overlay] = drives();
        assert!(root.is_root_device && root.is_read_only);
        assert!(!overlay.is_root_device && !overlay.is_read_only);
    }
}
