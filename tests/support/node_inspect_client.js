// HTTPS GETs through the proxy in HTTPS_PROXY, trusting ONLY node's roots plus NODE_EXTRA_CA_CERTS.
// Why: node 20 has no built-in env-proxy support, so proxy-aware node agents CONNECT by hand; this does
// the same, then tls.connect WITHOUT a `ca` option, so egressd's certificate for an intercepted host is
// accepted only if the NODE_EXTRA_CA_CERTS bundle egressd gives the child is enough.
// Usage: node node_inspect_client.js URL...  → one JSON line: [{connect, status, reason, body, error}, ...]
const http = require('http'), tls = require('tls');
const proxy = new URL(process.env.HTTPS_PROXY);
const auth = 'Basic ' + Buffer.from(decodeURIComponent(proxy.username) + ':' + decodeURIComponent(proxy.password)).toString('base64');

function get(url) { return new Promise((resolve) => {
  const u = new URL(url);
  const target = `${u.hostname}:${u.port || 443}`;
  const req = http.request({host: proxy.hostname, port: proxy.port, method: 'CONNECT', path: target,
    headers: {'Proxy-Authorization': auth, Host: target}});
  req.on('error', (e) => resolve({connect: null, error: String(e)}));
  req.on('connect', (res, socket) => {
    if (res.statusCode !== 200) {
      resolve({connect: res.statusCode, reason: res.headers['x-egressd-reason'] || null});
      socket.destroy(); return;
    }
    const s = tls.connect({socket, servername: u.hostname}, () => {
      s.write(`GET ${u.pathname}${u.search} HTTP/1.1\r\nHost: ${u.host}\r\nConnection: close\r\n\r\n`);
    });
    let data = Buffer.alloc(0);
    s.on('data', (d) => { data = Buffer.concat([data, d]); });
    s.on('error', (e) => resolve({connect: 200, error: String(e.code || e)}));
    s.on('end', () => {
      const text = data.toString('latin1');
      const [head, ...rest] = text.split('\r\n\r\n');
      const lines = head.split('\r\n');
      const headers = {};
      for (const line of lines.slice(1)) {
        const i = line.indexOf(':');
        if (i > 0) headers[line.slice(0, i).trim().toLowerCase()] = line.slice(i + 1).trim();
      }
      resolve({connect: 200, status: parseInt(lines[0].split(' ')[1]), reason: headers['x-egressd-reason'] || null,
        body: rest.join('\r\n\r\n').slice(0, 2000)});
    });
  });
  req.end();
}); }

(async () => {
  const results = [];
  for (const url of process.argv.slice(2)) results.push(await get(url));
  console.log(JSON.stringify(results));
})();
