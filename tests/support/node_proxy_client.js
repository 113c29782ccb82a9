// node 20 has no built-in proxy support for fetch: speak to the proxy from HTTP_PROXY by hand,
// absolute-form for http:// and CONNECT + TLS for https://, as proxy-aware node agents do.
const http = require('http'), tls = require('tls'), fs = require('fs');
const proxy = new URL(process.env.HTTP_PROXY);
const auth = 'Basic ' + Buffer.from(decodeURIComponent(proxy.username) + ':' + decodeURIComponent(proxy.password)).toString('base64');
function plain(url) { return new Promise((resolve) => {
  const req = http.request({host: proxy.hostname, port: proxy.port, method: 'GET', path: url,
    headers: {'Proxy-Authorization': auth, Host: new URL(url).host}}, (res) => {
      let body = ''; res.on('data', (d) => body += d); res.on('end', () => resolve([res.statusCode, res.headers['x-egressd-reason'] || null]));
  }); req.end(); }); }
function secure(url) { return new Promise((resolve) => {
  const u = new URL(url);
  const req = http.request({host: proxy.hostname, port: proxy.port, method: 'CONNECT', path: `${u.hostname}:${u.port || 443}`,
    headers: {'Proxy-Authorization': auth}});
  req.on('connect', (res, socket) => {
    if (res.statusCode !== 200) { resolve([res.statusCode, res.headers['x-egressd-reason'] || null]); socket.destroy(); return; }
    const s = tls.connect({socket, servername: u.hostname, ca: fs.readFileSync(process.env.CA_FILE)}, () => {
      s.write(`GET ${u.pathname} HTTP/1.1\r\nHost: ${u.host}\r\nConnection: close\r\n\r\n`); });
    let data = ''; s.on('data', (d) => data += d); s.on('end', () => resolve([parseInt(data.split(' ')[1]), null]));
  }); req.end(); }); }
(async () => {
  const [a, b, c] = process.argv.slice(2);
  console.log(JSON.stringify([await plain(a), await plain(b), await secure(c), await secure('https://elsewhere.test/')]));
})();
