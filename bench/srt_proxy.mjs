// sandbox-runtime's proxy on its own, started the way `srt` starts it for a sandboxed command:
// SandboxManager.initialize(settings) with the settings file validated by srt's own config loader.
// That starts srt's one-port HTTP + SOCKS front (the "mux") on 127.0.0.1 with its per-run proxy
// token, and on Linux the socat bridges a sandbox would reach it through (idle here). No command
// runs; the bench's clients are the proxy's clients.
//
//   node bench/srt_proxy.mjs PACKAGE_DIR SETTINGS.json
//
// Prints one JSON line, {"port": ..., "token": ..., "version": ...}, then serves until SIGTERM.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [packageDir, settingsPath] = process.argv.slice(2);
const load = (file) => import(pathToFileURL(join(packageDir, 'dist', file)).href);
const { SandboxManager } = await load('index.js');
const { loadConfig } = await load('utils/config-loader.js');
const loaded = loadConfig(settingsPath);
if (loaded.kind !== 'ok') {
  console.error(`srt_proxy: ${settingsPath}: ${loaded.kind} ${loaded.reason ?? ''}`);
  process.exit(2);
}
await SandboxManager.initialize(loaded.config);
const version = JSON.parse(readFileSync(join(packageDir, 'package.json'), 'utf8')).version;
process.stdout.write(
  JSON.stringify({
    port: SandboxManager.getProxyPort(),
    token: SandboxManager.getProxyAuthToken(),
    version,
  }) + '\n',
);
const stop = async () => {
  await SandboxManager.reset().catch(() => {});
  process.exit(0);
};
process.once('SIGTERM', stop);
process.once('SIGINT', stop);
setInterval(() => {}, 1 << 30); // the proxy's servers are unref'd: keep the process alive
