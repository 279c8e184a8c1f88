//! `teeguard-standalone`: see teeguard work on one machine, without a cluster.
//!
//! Starts the real agent on a simulated TDX host and the real webhook over HTTPS against an in-process
//! Kubernetes API server, plays a short scenario (VMs filling the host, keys taken outside Kubernetes,
//! a VM stopping) printing what the webhook patched, admitted and refused and why, then keeps serving
//! and prints a `curl` command to try it yourself, until Ctrl-C.
//!
//! ```text
//! cargo run -p teeguard-tests --bin teeguard-standalone [-- --port 8443 --keys 8 --no-wait --verbose]
//! ```

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use teeguard_tests::standalone::cluster::{PLAIN_NODE, SAMPLE_REVIEW, TEE_NODE};
use teeguard_tests::standalone::{Standalone, StandaloneOptions, run_scenario, summary};
use teeguard_tests::{Error, Result};

/// See the teeguard webhook and agent do their job on one machine, without a cluster.
#[derive(Debug, Parser)]
#[command(name = "teeguard-standalone", version, about)]
struct Args {
    /// HTTPS port of the webhook on 127.0.0.1 (0: any free port).
    #[arg(long, default_value_t = 8443)]
    port: u16,
    /// TDX keys of the simulated host (4 to 64).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(4..=64))]
    keys: u64,
    /// Exit after the scenario instead of serving until Ctrl-C.
    #[arg(long, alias = "exit")]
    no_wait: bool,
    /// Show the webhook's and agent's logs on stderr (filter: RUST_LOG, default info) instead of
    /// writing them to teeguard.log in the temporary directory.
    #[arg(long, short)]
    verbose: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("teeguard-standalone: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("teeguard-standalone: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_logs(verbose: bool, log_file: &std::path::Path) -> Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if verbose {
        let _ = builder.with_writer(std::io::stderr).try_init();
    } else {
        let file = std::fs::File::create(log_file).map_err(|source| Error::Io {
            component: "standalone",
            what: format!("create {}", log_file.display()),
            source,
        })?;
        let _ = builder
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(file))
            .try_init();
    }
    Ok(())
}

async fn run(args: Args) -> Result<()> {
    let opts = StandaloneOptions {
        port: args.port,
        tdx_keys: args.keys,
        poll_interval: Duration::from_millis(100),
    };
    // Logs go to a file next to the other state; it must exist before the components start.
    let log_dir = tempfile::Builder::new()
        .prefix("teeguard-standalone-logs-")
        .tempdir()
        .map_err(|source| Error::Io {
            component: "standalone",
            what: format!(
                "create a temporary directory in {}",
                std::env::temp_dir().display()
            ),
            source,
        })?;
    let log_file = log_dir.path().join("teeguard.log");
    init_logs(args.verbose, &log_file)?;

    println!("teeguard standalone: the real webhook and agent against a simulated cluster\n");
    let mut sa = Standalone::start(&opts).await?;
    println!("  API server  {} (simulated)", sa.api_url());
    println!("              kubeconfig {}", sa.paths.kubeconfig.display());
    println!(
        "  {TEE_NODE}      TDX host with {} keys, teeguard agent running",
        opts.tdx_keys
    );
    println!("              cgroup tree {}", sa.host.root().display());
    println!("  {PLAIN_NODE}      worker without TEE hardware");
    println!(
        "  webhook     https://{}, /readyz on http://{}",
        sa.https_addr, sa.admin_addr
    );
    println!(
        "              certificates in {}",
        sa.paths.cert_dir.display()
    );
    if !args.verbose {
        println!("  logs        {}", log_file.display());
    }
    println!(
        "\nEach TDX VM below goes the way it goes in a cluster: VMI created, virt-launcher pod sent to\n\
         /mutate and /validate, scheduled, binding sent to /validate, bound, VM started on {TEE_NODE}.\n\
         FREE is {TEE_NODE}'s free TDX keys after the step, as its agent published them.\n"
    );
    let mut stdout = std::io::stdout();
    let result = run_scenario(&sa, &mut stdout).await;
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            sa.stop().await;
            return Err(e);
        }
    };
    println!("\n{}", summary(&report));

    println!(
        "Try it yourself: the webhook keeps serving. This sends it the pod CREATE review of the\n\
         virt-launcher pod of VMI default/tdx-vm ({SAMPLE_REVIEW}, with the\n\
         VMI's UID as the simulated API server assigned it); the answer carries a base64 JSON patch:\n"
    );
    println!("{}\n", sa.curl_command());
    let _ = stdout.flush();
    if args.no_wait {
        sa.stop().await;
        return Ok(());
    }
    println!("Press Ctrl-C to stop.");
    let _ = stdout.flush();
    if let Err(e) = tokio::signal::ctrl_c().await {
        eprintln!("teeguard-standalone: cannot wait for Ctrl-C ({e}); stopping");
    }
    println!("\nstopping...");
    sa.stop().await;
    Ok(())
}
