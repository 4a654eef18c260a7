//! SIGINT, SIGTERM and SIGUSR1 during `pipebd run`: the first asks the run
//! to stop after the steps in flight (every block's checkpoint written, the
//! resume command printed, exit code 128 + signal: 130 for Ctrl-C, 143 for a
//! scheduler's SIGTERM, 138 for SIGUSR1); a second one ends the process at
//! once with that code. SIGUSR1 is for `mpirun`, which forwards it to every
//! rank (on SIGINT and SIGTERM it kills the ranks itself after a short grace).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};

use crate::Error;
use pipe_bd::runtime::interrupt::{signal_name, Interrupt};

/// Routes SIGINT, SIGTERM and SIGUSR1 to `interrupt` for the rest of the process,
/// and says once on stderr what the first one does.
pub(super) fn stop_on_signals(interrupt: &Interrupt, announce: bool) -> Result<(), Error> {
    let second = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM, SIGUSR1] {
        let failed = |e: std::io::Error| Error::Timeout {
            message: format!("could not install the {} handler: {e}", signal_name(signal)),
        };
        // In order: a signal after the first exits at once; the first one
        // arms that and asks the run to stop.
        signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, second.clone())
            .map_err(failed)?;
        signal_hook::flag::register(signal, second.clone()).map_err(failed)?;
        signal_hook::flag::register_usize(signal, interrupt.flag(), signal as usize).map_err(failed)?;
    }
    if announce {
        let interrupt = interrupt.clone();
        std::thread::spawn(move || loop {
            if let Some(signal) = interrupt.requested() {
                // A warning: even a quiet run says why it stops.
                let message = format!(
                    "{}: finishing the steps in flight and writing every block's checkpoint \
                     (send it again to stop at once)",
                    signal_name(signal)
                );
                crate::reporter::reporter().warn("pipebd", &message);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        });
    }
    Ok(())
}

/// The command that continues an interrupted run: this process's command
/// line with `--resume <out>` (replacing a `--resume` it had), behind
/// `mpirun -n <ranks>` for a run over several processes.
pub(super) fn resume_command(out: &std::path::Path, ranks: usize) -> String {
    let mut args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--resume") {
        args.drain(i..(i + 2).min(args.len()));
    }
    args.retain(|a| !a.starts_with("--resume="));
    args.push("--resume".into());
    args.push(out.display().to_string());
    let quoted: Vec<String> = args.iter().map(|a| shell_quote(a)).collect();
    let launcher = if ranks > 1 { format!("mpirun -n {ranks} ") } else { String::new() };
    format!("{launcher}{}", quoted.join(" "))
}

fn shell_quote(arg: &str) -> String {
    if !arg.is_empty() && arg.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c)) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_that_need_quotes_get_them() {
        assert_eq!(shell_quote("runs/a-b"), "runs/a-b");
        assert_eq!(shell_quote("my run"), "'my run'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
