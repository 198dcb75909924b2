// embserve_maps_check ARTIFACT [full|none]: loads the artifact (LoadOptions::verify), runs nothing, and prints
// every line of its own /proc/self/maps that names a file inside the artifact folder, as "map: <line>", then
// "ok". Lets tests see how the loader maps a version 3 artifact's weight files (permissions, private/shared)
// while the model is alive. Load failures: "<message>" on stderr, exit 1.
#include <embserve/loader.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: embserve_maps_check ARTIFACT [full|none]\n";
    return 2;
  }
  embserve::LoadOptions options;
  if (argc > 2 && std::string(argv[2]) == "none") options.verify = embserve::Verify::None;
  try {
    const embserve::Model model = embserve::Model::load(argv[1], options);
    const std::string folder = std::filesystem::canonical(argv[1]).string() + "/";
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);)
      if (line.find(folder) != std::string::npos) std::cout << "map: " << line << "\n";
    std::cout << "ok " << model.features().size() << " features\n";
  } catch (const std::exception& err) {
    std::cerr << err.what() << "\n";
    return 1;
  }
  return 0;
}
