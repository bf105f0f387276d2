//! `install-module <directory> [--from <path>]`: the entrypoint of the native module's image
//! (images/native.Dockerfile), run as an init container.
//!
//! Kubernetes mounts image volumes `noexec`, so Envoy's dlopen of the module straight out of
//! one may fail. The image copies the module instead, into a directory it shares with the
//! Envoy container (an emptyDir that container mounts at /etc/envoy/dynamic-modules): no
//! shell, no `cp`, any Kubernetes.
//!
//! It copies `/libidempotency_native.so` (where the image holds it; `--from` names another
//! file, for tests) to `<directory>/libidempotency_native.so` atomically: a temporary file in
//! the same directory, written, mode 0644, synced, its length checked, then renamed over the
//! final name. Envoy never sees half a module, and an old one (an init container that runs
//! again on the same emptyDir) is replaced whole. One line on stdout says what it installed;
//! any error exits 1 with the reason on stderr, leaving no temporary file behind.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sha2::{Digest, Sha256};

/// Where the image holds the module: its root, next to this binary.
const MODULE: &str = "/libidempotency_native.so";
/// The module's name in the target directory, the file Envoy's configuration names.
const FILE_NAME: &str = "libidempotency_native.so";
/// Read by Envoy whatever user it runs as; written by nobody after this.
const MODE: u32 = 0o644;

const USAGE: &str = "usage: install-module <directory> [--from <path>]

  Copies the Envoy dynamic module (--from, by default /libidempotency_native.so) into
  <directory>/libidempotency_native.so, atomically (a temporary file renamed over it).";

#[derive(Debug, PartialEq)]
struct Args {
    dir: PathBuf,
    from: PathBuf,
}

/// The command line without the program's name: the arguments, or None for `--help`.
fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Option<Args>, String> {
    let mut dir = None;
    let mut from = None;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "--from" {
            let path = args.next().ok_or("--from needs a path")?;
            if from.replace(PathBuf::from(path)).is_some() {
                return Err("--from given twice".into());
            }
        } else if arg == "-h" || arg == "--help" {
            return Ok(None);
        } else if arg.to_string_lossy().starts_with('-') {
            return Err(format!("unknown option {}", arg.to_string_lossy()));
        } else if dir.replace(PathBuf::from(arg)).is_some() {
            return Err("one directory only".into());
        }
    }
    let dir = dir.ok_or("missing the directory to install the module into")?;
    Ok(Some(Args {
        dir,
        from: from.unwrap_or_else(|| PathBuf::from(MODULE)),
    }))
}

/// What [`install`] wrote.
#[derive(Debug)]
struct Installed {
    path: PathBuf,
    bytes: u64,
    sha256: String,
}

/// Copies `from` to `dir`/[`FILE_NAME`] through a temporary file in `dir`, which is gone
/// again whatever the outcome.
fn install(from: &Path, dir: &Path) -> Result<Installed, String> {
    let mut source =
        File::open(from).map_err(|e| format!("cannot read the module {}: {e}", from.display()))?;
    let meta = source
        .metadata()
        .map_err(|e| format!("cannot read the module {}: {e}", from.display()))?;
    if !meta.is_file() {
        return Err(format!("the module {} is not a file", from.display()));
    }
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(format!(
                "cannot install into {}: not a directory",
                dir.display()
            ))
        }
        Err(e) => return Err(format!("cannot install into {}: {e}", dir.display())),
    }
    let path = dir.join(FILE_NAME);
    let temp = dir.join(format!(".{FILE_NAME}.tmp-{}", std::process::id()));
    // A temporary file left by a run that was killed (in a container the PID is the same
    // each time): removed, so that the new one is created afresh, never through a link.
    match fs::remove_file(&temp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot remove {}: {e}", temp.display())),
    }
    let written = write_temp(&mut source, &temp, meta.len()).and_then(|sha256| {
        fs::rename(&temp, &path).map_err(|e| {
            format!(
                "cannot rename {} to {}: {e}",
                temp.display(),
                path.display()
            )
        })?;
        Ok(sha256)
    });
    let sha256 = match written {
        Ok(sha256) => sha256,
        Err(e) => {
            let _ = fs::remove_file(&temp);
            return Err(e);
        }
    };
    // The rename made durable; the module is in place already, so a failure here only
    // weakens that, and is no reason to fail the pod.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(Installed {
        path,
        bytes: meta.len(),
        sha256,
    })
}

/// Writes `source` into a new file `temp` (mode [`MODE`], synced), checks it holds
/// `expected` bytes, and returns their sha256 in hex.
fn write_temp(source: &mut File, temp: &Path, expected: u64) -> Result<String, String> {
    let at = |e: io::Error| format!("cannot write {}: {e}", temp.display());
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(MODE)
        .open(temp)
        .map_err(at)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut copied: u64 = 0;
    loop {
        let n = match source.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("cannot read the module: {e}")),
        };
        let chunk = buf.get(..n).unwrap_or_default();
        hasher.update(chunk);
        out.write_all(chunk).map_err(at)?;
        copied += chunk.len() as u64;
    }
    // The umask may have taken bits off the mode `open` asked for.
    out.set_permissions(Permissions::from_mode(MODE))
        .map_err(at)?;
    out.sync_all().map_err(at)?;
    let length = out.metadata().map_err(at)?.len();
    if copied != expected || length != expected {
        return Err(format!(
            "the copy holds {length} bytes, the module {expected}: not installed"
        ));
    }
    let mut hex = String::with_capacity(64);
    for byte in hasher.finalize() {
        let _ = write!(hex, "{byte:02x}");
    }
    Ok(hex)
}

fn main() -> ExitCode {
    let args = match parse(std::env::args_os().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("install-module: {e}\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    match install(&args.from, &args.dir) {
        Ok(done) => {
            println!(
                "installed {} ({} bytes, sha256 {}) from {}",
                done.path.display(),
                done.bytes,
                done.sha256,
                args.from.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("install-module: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty directory of the test's own under the system's temporary directory.
    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("install-module-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_copy_lands_whole_and_replaces_an_old_one() {
        let root = scratch("whole");
        let (source, target) = (root.join("module.so"), root.join("modules"));
        fs::create_dir(&target).unwrap();
        // Larger than the copy's buffer, and not a multiple of it.
        let module: Vec<u8> = (0..700_001u32).map(|i| (i % 251) as u8).collect();
        fs::write(&source, &module).unwrap();
        fs::write(target.join(FILE_NAME), b"an older module").unwrap();
        fs::set_permissions(target.join(FILE_NAME), Permissions::from_mode(0o600)).unwrap();

        let done = install(&source, &target).unwrap();
        assert_eq!(done.path, target.join(FILE_NAME));
        assert_eq!(done.bytes, module.len() as u64);
        assert_eq!(fs::read(target.join(FILE_NAME)).unwrap(), module);
        let mode = fs::metadata(target.join(FILE_NAME))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, MODE);
        assert_eq!(names_in(&target), [FILE_NAME]);
        let want: String = Sha256::digest(&module)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(done.sha256, want);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_missing_source_fails_without_leaving_a_temporary_file() {
        let root = scratch("missing-source");
        let (source, target) = (root.join("absent.so"), root.join("modules"));
        fs::create_dir(&target).unwrap();
        let error = install(&source, &target).unwrap_err();
        assert!(error.contains(&source.display().to_string()), "{error}");
        assert!(names_in(&target).is_empty());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_missing_directory_fails_naming_it() {
        let root = scratch("missing-dir");
        let source = root.join("module.so");
        fs::write(&source, b"module").unwrap();
        let target = root.join("no-such-dir");
        let error = install(&source, &target).unwrap_err();
        assert!(error.contains(&target.display().to_string()), "{error}");
        assert!(!target.exists());
        // A file where the directory should be fails the same way.
        let error = install(&source, &source).unwrap_err();
        assert!(error.contains("not a directory"), "{error}");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_stale_temporary_file_is_replaced() {
        let root = scratch("stale");
        let (source, target) = (root.join("module.so"), root.join("modules"));
        fs::create_dir(&target).unwrap();
        fs::write(&source, b"module").unwrap();
        let stale = target.join(format!(".{FILE_NAME}.tmp-{}", std::process::id()));
        fs::write(&stale, b"half a module from a killed run").unwrap();
        install(&source, &target).unwrap();
        assert_eq!(fs::read(target.join(FILE_NAME)).unwrap(), b"module");
        assert_eq!(names_in(&target), [FILE_NAME]);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_command_line() {
        let args = |list: &[&str]| parse(list.iter().map(OsString::from));
        assert_eq!(
            args(&["/modules"]).unwrap(),
            Some(Args {
                dir: "/modules".into(),
                from: MODULE.into()
            })
        );
        let custom = Some(Args {
            dir: "/d".into(),
            from: "/x.so".into(),
        });
        assert_eq!(args(&["/d", "--from", "/x.so"]).unwrap(), custom);
        assert_eq!(args(&["--from", "/x.so", "/d"]).unwrap(), custom);
        assert_eq!(args(&["--help"]).unwrap(), None);
        assert!(args(&[]).unwrap_err().contains("missing the directory"));
        assert!(args(&["/d", "--from"])
            .unwrap_err()
            .contains("--from needs a path"));
        assert!(args(&["/d", "/e"]).unwrap_err().contains("one directory"));
        assert!(args(&["/d", "--force"])
            .unwrap_err()
            .contains("unknown option --force"));
    }
}
