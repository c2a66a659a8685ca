//! The processes of a model split across ranks: under `mpirun` each finds its rank, and
//! all but the leading one only follow its commands; typed without `mpirun`, the command
//! starts itself under it on this host, one process per rank.

use anyhow::Result;
use ferrite_model::loader::{self, EngineArgs};
use ferrite_model::parallel;

/// Returns on the leading rank (or when the model is not split); a following rank's
/// process ends here when the leader stops it.
pub fn enter(args: &EngineArgs) -> Result<()> {
    if args.world_size() <= 1 {
        return Ok(());
    }
    #[cfg(feature = "mpi")]
    if !parallel::mpi::launched() {
        relaunch(args.world_size());
    }
    let group = parallel::join(args.tensor_parallel_size, args.pipeline_parallel_size)?;
    if group.is_none_or(|g| g.leads()) {
        return Ok(());
    }
    let followed = loader::follow(args);
    parallel::finish();
    if let Err(e) = followed {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
    std::process::exit(0)
}

/// This command again under `mpirun`, `ranks` processes on this host (sharing its cores:
/// no binding, oversubscribed past them).
#[cfg(feature = "mpi")]
fn relaunch(ranks: usize) -> ! {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().expect("this executable's path");
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args([
        "-n",
        &ranks.to_string(),
        "--bind-to",
        "none",
        "--oversubscribe",
    ]);
    // Open MPI refuses root unless told (containers run as root).
    if std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
        cmd.arg("--allow-run-as-root");
    }
    cmd.arg(exe).args(std::env::args_os().skip(1));
    tracing::info!("starting {ranks} ranks: {cmd:?}");
    let e = cmd.exec();
    eprintln!("error: starting `mpirun` (Debian's openmpi-bin): {e}");
    std::process::exit(1)
}
